"""The health service: canary checks, circuit breakers, liveness and degradation."""
