"""The lab's GPU suite: jobs (`suite`), their verdicts (`verdicts`) and a resumable runner (`runner`)."""
