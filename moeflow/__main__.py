from moeflow.cli.main import main

raise SystemExit(main())
