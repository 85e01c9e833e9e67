from meshtrain.commands import main

raise SystemExit(main())
