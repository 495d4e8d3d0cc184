"""What GitHub says: the REST client (client), the refresh of registrations and queued runs
(sync), the job history (history) and the workflow files (workflow_files)."""
