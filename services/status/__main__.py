from services.status import main

raise SystemExit(main())
