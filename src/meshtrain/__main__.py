from meshtrain.cli import main

raise SystemExit(main())
