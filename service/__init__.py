"""Slipstream service, in rooms:

- ``engine/``    step loop, runner, events, config, calibration, detokenizer
- ``models/``    Llama-family model code and the model store
- ``api/``       gRPC server, servicer, sessions, wire conversion, status table
- ``telemetry/`` tracing, request traces, metrics, logging
- ``cli/``       the ``slipstream`` command, one module per subcommand
- ``bench/``     benchmarks against peers
"""
