"""Engine failover: the failover lock and the shared weight memory a shadow engine maps."""
