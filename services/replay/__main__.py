from services.replay import main

raise SystemExit(main())
