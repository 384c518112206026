"""Operations: the ``rlpost`` command line, Ray Jobs, ``rlpost doctor``, the monitoring stack (Grafana
dashboard, alert rules, a local Prometheus) and local multi-node clusters for tests and chaos runs."""
