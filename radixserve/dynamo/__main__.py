"""`python -m radixserve.dynamo`: one radixserve engine as a Dynamo worker (worker.py)."""

import sys

from radixserve.dynamo.worker import main

sys.exit(main())
