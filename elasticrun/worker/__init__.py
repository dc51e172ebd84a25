"""Runtime inside a training process: driver client, collectives, elastic state and run."""
