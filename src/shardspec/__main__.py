try:
    from shardspec.cli import run
except KeyboardInterrupt:  # (Ctrl-C while the imports run: no traceback)
    raise SystemExit(130) from None

run()
