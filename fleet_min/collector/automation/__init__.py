"""Automation: schedules (cron templates fired by a tick), alerts (rules over a snapshot of the
fleet) and the alert webhook."""
