from services.up import main

raise SystemExit(main())
