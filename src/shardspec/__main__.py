try:
    from shardspec.cli import main
except KeyboardInterrupt:  # (Ctrl-C while the imports run: no traceback)
    raise SystemExit(130) from None

raise SystemExit(main())
