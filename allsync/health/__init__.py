"""Health: per-worker signals, the faulty-worker detector and fault drills.

monitor.py   what each worker reports per step (tokens/s, memory, phases) and its timeline
detector.py  finding the faulty worker from those reports (`allsync health`, health.detector)
faults.py    fault drills a config injects (health.faults) to test the detector and the restarts
"""
