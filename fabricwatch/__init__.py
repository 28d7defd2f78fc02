"""fabricwatch: streaming anomaly detection over GPU-cluster fabric telemetry.

The top-level folders of the repository are the architecture, installed under this
namespace: ``fabricwatch.collectors`` produce, ``fabricwatch.protos`` define,
``fabricwatch.streams`` move, ``fabricwatch.models`` decide, ``fabricwatch.actions`` act.
This package holds the CLI and the few pieces every layer shares.
"""

__version__ = "0.1.0"
