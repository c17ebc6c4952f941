from hybridkv.cli import main

raise SystemExit(main())
