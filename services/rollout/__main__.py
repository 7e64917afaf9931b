from services.rollout import main

raise SystemExit(main())
