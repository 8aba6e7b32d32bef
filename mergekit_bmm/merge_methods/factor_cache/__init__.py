"""bmm's factor cache: λ-independent eigen-factors of each weight's normal equations, kept on disk.

``key`` names an entry by what the solve depends on, ``store`` reads and writes entries,
``fill`` computes them, ``precision`` chooses the stored dtype that keeps a merge within tolerance.
"""
