"""fabricwatch.actions: what acts on anomalies.

``policy`` maps anomalies to actions (validated YAML, shadow by default); ``guards`` holds
the guard rails (kill switch, blast-radius breaker, cooldown, idempotency ledger, flap
memory); ``responder`` decides, pure and synchronous; ``executors/`` carry actions out
(Slurm, Kubernetes, a command/webhook for job restart, switch ports); ``alerts/`` tell
on-call (Alertmanager, PagerDuty, Slack, Feishu, WeCom). Kafka and gRPC stay in
``fabricwatch.streams``: this package sees protobuf messages and dataclasses only.
"""
