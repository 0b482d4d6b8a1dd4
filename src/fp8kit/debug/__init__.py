"""Debugging FP8 training: the numerics inspector, NaN and loss-spike detectors, and the doctor."""

from .detectors import NaNDetector, NonFiniteError, Spike, SpikeDetector
from .doctor import Culprit, DoctorReport, Recommendation, doctor
from .inspector import Inspector, inspect, read_stats
from .stats import operand_stats

__all__ = [
    "Culprit",
    "DoctorReport",
    "Inspector",
    "NaNDetector",
    "NonFiniteError",
    "Recommendation",
    "Spike",
    "SpikeDetector",
    "doctor",
    "inspect",
    "operand_stats",
    "read_stats",
]
