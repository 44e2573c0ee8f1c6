try:
    from cardtool.cli import main
except KeyboardInterrupt:  # Ctrl-C while Python loads the CLI: nothing has started, so nothing to report
    raise SystemExit(130) from None

main()
