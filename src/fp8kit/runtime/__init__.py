"""Where and how a job runs: the device it runs on and what that device runs natively (``device``), and the
progress bars every long phase shows (``progress``)."""
