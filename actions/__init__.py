"""fabricwatch.actions: what acts on anomalies (policy, guard rails, executors, alerts).

Not built yet (issue 5). Detectors never act: they emit `AnomalyEvent`s on the anomalies
topic, which this layer will consume.
"""
