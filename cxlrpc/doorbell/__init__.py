"""How consumers learn of new records: wait strategies and the park/wake doorbell."""
from .bell import Doorbell, DoorbellReceiver, wake_address
from .strategy import WaitStrategy, adaptive, busy_spin, resolve, spin_yield

__all__ = ["Doorbell", "DoorbellReceiver", "wake_address", "WaitStrategy", "adaptive", "busy_spin",
           "spin_yield", "resolve"]
