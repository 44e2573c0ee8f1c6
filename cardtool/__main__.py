"""`python -m cardtool` and the `cardtool` console script."""


def run() -> None:
    try:
        from cardtool.cli import main
    except KeyboardInterrupt:  # Ctrl-C while Python loads the CLI: nothing has started, so nothing to report
        raise SystemExit(130) from None
    main()


if __name__ == "__main__":
    run()
