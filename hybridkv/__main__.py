from hybridkv.serving.cli import main

raise SystemExit(main())
