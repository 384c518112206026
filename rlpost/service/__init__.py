"""The post-training service: the run's clients of its actors, the supervisor (mends what is lost), the
watchdog (frozen and hung actors), the control mailbox, the training loop, the run state, evaluation."""
