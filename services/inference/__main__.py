from services.inference import main

raise SystemExit(main())
