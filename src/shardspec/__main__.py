from shardspec.cli import main

raise SystemExit(main())
