import sys

from service.worker.main import main

sys.exit(main())
