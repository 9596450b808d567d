"""When rows compact and which slots they keep: the schedule and the selection."""
