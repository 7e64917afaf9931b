from services.trainer import main

raise SystemExit(main())
