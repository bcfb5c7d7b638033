"""`python -m service.worker`: the worker process the server starts, one per device."""

import sys

from service.worker.main import main

sys.exit(main())
