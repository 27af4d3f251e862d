from nmt.cli import main

raise SystemExit(main())
