"""The slot: one worker process serving one queue at a time."""
