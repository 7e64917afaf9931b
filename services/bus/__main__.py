from services.bus import main

raise SystemExit(main())
