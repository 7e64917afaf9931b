"""The trainer's intake: trajectory messages in (the durable consumer), judged (decoded, checked,
accepted or counted by cause), and the accepted groups collated into a step's batch."""
