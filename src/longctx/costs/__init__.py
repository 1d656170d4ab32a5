"""Predicted costs, below parallel/, train/ and planner/, which all read them: device peaks
(peaks.py), hardware figures (hardware.py), model-state bytes (model_states.py), step timing
(timing.py) and the mesh shape they are computed for (shape.py)."""
