"""The Ray process helpers every role uses: an actor's liveness (heartbeat, progress), a bounded wait
for placement, graceful stop on signals, starting Ray for a run, functions a config names by path."""
