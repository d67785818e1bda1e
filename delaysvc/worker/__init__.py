"""Running handlers: the consumer, the handler registry, topic limits."""
