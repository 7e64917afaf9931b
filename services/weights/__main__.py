from services.weights import main

raise SystemExit(main())
