"""What happens around `fit()`: when to save, resuming, preemption, and the
state of the other callbacks."""
