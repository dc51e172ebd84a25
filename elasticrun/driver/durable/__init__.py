"""Durable copies: the checkpoint directory and the service that writes and reads it."""
