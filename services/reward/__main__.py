from services.reward import main

raise SystemExit(main())
