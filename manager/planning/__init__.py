"""The manager's planning round: slots per queue (``plan``, ``types``), their hosts
(``placement``), the jobs arrived (``arrivals``), one round decided (``rounds``) and run
(``round_loop``), its recording (``recorder``) and the periodic jobs it ticks
(``periodic``, ``learned_periodic``)."""
