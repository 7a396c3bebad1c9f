"""Engine failover (issue 14): the failover lock and the shared weight memory a shadow engine maps."""
