"""Executors: the plugins that carry an `ActionRequest` out on one system.

Each implements the `fabricwatch.actions.base.Executor` protocol (``name``, ``handles``,
``async execute(request) -> ExecutionResult``), is idempotent on the target's state and
never raises for a refused or failed action. ``slurm`` drains, resumes and requeues
through ``scontrol``; ``kubernetes`` cordons, taints and evicts through the official client
(PodDisruptionBudgets respected); ``command`` restarts a job without a node through the
user's launcher, as a command (argv template, no shell) or a signed webhook; ``switch_port``
admin-downs and restores a switch port with a gNMI Set of OpenConfig ``config/enabled``.
Each backend's client library is imported only by its own module.
"""
