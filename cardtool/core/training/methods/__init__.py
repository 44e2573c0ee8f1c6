"""Training methods: each builds a Task for the shared trainer and the card it writes."""
