"""Put on PYTHONPATH to run a process as if numpy were not installed (it is not a dependency
of elasticrun; the test extras pull it in, which once hid a call to ``tensor.numpy()``)."""

import sys

sys.modules["numpy"] = None  # type: ignore[assignment]  # `import numpy` raises ImportError
