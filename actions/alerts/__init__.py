"""Alert sinks: Alertmanager, PagerDuty, Slack, Feishu/Lark, WeCom."""
