from services.track import main

raise SystemExit(main())
