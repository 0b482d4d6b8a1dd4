"""Debugging FP8 training: the numerics inspector, NaN and loss-spike detectors, early-warning trends and the doctor."""

from .detectors import NaNDetector, NonFiniteError, Spike, SpikeDetector
from .doctor import Culprit, DoctorReport, Recommendation, doctor
from .inspector import Inspector, inspect, read_stats
from .stats import operand_stats
from .trends import Trend, find_trends

__all__ = [
    "Culprit",
    "DoctorReport",
    "Inspector",
    "NaNDetector",
    "NonFiniteError",
    "Recommendation",
    "Spike",
    "SpikeDetector",
    "Trend",
    "doctor",
    "find_trends",
    "inspect",
    "operand_stats",
    "read_stats",
]
