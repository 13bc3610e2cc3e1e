use super::*;
use crate::config::Config;

/// A lookup over `vars`.
fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + use<> {
    let vars: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
        .collect();
    move |name| vars.get(name).cloned()
}

/// torchrun's variables as `vars` describe the job.
fn seen(vars: &[(&str, &str)]) -> (Launcher, impl Fn(&str) -> Option<String> + use<>) {
    let e = env(vars);
    let job = LaunchedJob::find(&e).unwrap().expect("a launcher");
    let launcher = job.launcher;
    (launcher, move |name: &str| job.lookup(name, &e))
}

/// The variables `mpirun -np 2` (OpenMPI 4.1.4) set for rank 1 on one
/// machine, as recorded.
const OPEN_MPI_ONE_MACHINE: &[(&str, &str)] = &[
    ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
    ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
    ("OMPI_COMM_WORLD_NODE_RANK", "1"),
    ("OMPI_COMM_WORLD_RANK", "1"),
    ("OMPI_COMM_WORLD_SIZE", "2"),
    ("OMPI_MCA_ess_base_jobid", "898891777"),
    ("OMPI_MCA_orte_ess_num_procs", "2"),
    (
        "OMPI_MCA_orte_hnp_uri",
        "898891776.0;tcp://192.0.2.2:34317;tcp6://[fd00::2]:39961",
    ),
    ("PMIX_RANK", "1"),
];

#[test]
fn open_mpi_on_one_machine_meets_on_loopback_at_a_port_of_its_job() {
    let (launcher, v) = seen(OPEN_MPI_ONE_MACHINE);
    assert_eq!(launcher, Launcher::OpenMpi);
    assert_eq!(v("RANK").as_deref(), Some("1"));
    assert_eq!(v("WORLD_SIZE").as_deref(), Some("2"));
    assert_eq!(v("LOCAL_RANK").as_deref(), Some("1"));
    assert_eq!(v("LOCAL_WORLD_SIZE").as_deref(), Some("2"));
    assert_eq!(v("MASTER_ADDR").as_deref(), Some("127.0.0.1"));
    let port: u32 = v("MASTER_PORT").unwrap().parse().unwrap();
    assert!((15_000..25_000).contains(&port), "{port}");
    // Every rank of the job derives the same port; another job another.
    let mut rank0 = OPEN_MPI_ONE_MACHINE.to_vec();
    rank0.retain(|(k, _)| !k.contains("RANK"));
    rank0.extend([
        ("OMPI_COMM_WORLD_RANK", "0"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
    ]);
    assert_eq!(seen(&rank0).1("MASTER_PORT"), v("MASTER_PORT"));
    let mut other = OPEN_MPI_ONE_MACHINE.to_vec();
    other.retain(|(k, _)| *k != "OMPI_MCA_ess_base_jobid");
    other.push(("OMPI_MCA_ess_base_jobid", "898891778"));
    assert_ne!(seen(&other).1("MASTER_PORT"), v("MASTER_PORT"));
    assert_ne!(
        seen(&other).1("TORCHELASTIC_RUN_ID"),
        v("TORCHELASTIC_RUN_ID")
    );
    // The whole configuration.
    let c = Config::from_lookup(env(OPEN_MPI_ONE_MACHINE)).unwrap();
    assert_eq!((c.rank, c.world_size), (1, 2));
    assert_eq!(c.master_addr, "127.0.0.1");
    assert_eq!(u32::from(c.master_port), port);
}

#[test]
fn open_mpi_across_machines_meets_on_mpiruns_host_unless_told_otherwise() {
    let mut vars = OPEN_MPI_ONE_MACHINE.to_vec();
    vars.retain(|(k, _)| *k != "OMPI_COMM_WORLD_LOCAL_SIZE");
    vars.push(("OMPI_COMM_WORLD_LOCAL_SIZE", "1"));
    let (_, v) = seen(&vars);
    assert_eq!(v("MASTER_ADDR").as_deref(), Some("192.0.2.2"));
    assert_eq!(v("LOCAL_WORLD_SIZE").as_deref(), Some("1"));
    // Several addresses: the first.
    vars.push((
        "OMPI_MCA_orte_hnp_uri",
        "1.0;tcp://10.0.0.5,172.17.0.1:41835;tcp6://[fd00::2]:39961",
    ));
    vars.remove(
        vars.iter()
            .position(|(k, _)| *k == "OMPI_MCA_orte_hnp_uri")
            .unwrap(),
    );
    assert_eq!(seen(&vars).1("MASTER_ADDR").as_deref(), Some("10.0.0.5"));
    // MASTER_ADDR and MASTER_PORT override the derived meeting point.
    vars.extend([("MASTER_ADDR", "head"), ("MASTER_PORT", "1234")]);
    let (_, v) = seen(&vars);
    assert_eq!(v("MASTER_ADDR").as_deref(), Some("head"));
    assert_eq!(v("MASTER_PORT").as_deref(), Some("1234"));
}

#[test]
fn torchrun_comes_first_then_open_mpi_then_pmi_then_an_srun_step() {
    let mut vars = OPEN_MPI_ONE_MACHINE.to_vec();
    vars.extend([("RANK", "0"), ("WORLD_SIZE", "1")]);
    assert_eq!(seen(&vars).0, Launcher::Torchrun);
    // mpirun inside a Slurm allocation: mpirun's.
    let mut vars = OPEN_MPI_ONE_MACHINE.to_vec();
    vars.extend([
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "8"),
        ("SLURM_STEP_ID", "0"),
    ]);
    assert_eq!(seen(&vars).0, Launcher::OpenMpi);
    let pmi = [("PMI_RANK", "3"), ("PMI_SIZE", "4"), ("SLURM_PROCID", "0")];
    assert_eq!(seen(&pmi).0, Launcher::Pmi);
    // A batch script (no step) is no launched job.
    let batch = env(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "8")]);
    assert_eq!(LaunchedJob::find(&batch).unwrap(), None);
}

/// What MPICH 4.0.2's `mpiexec.hydra -n 2` sets for rank 1, as recorded:
/// no PMI_PORT in Hydra's default mode.
const HYDRA_ONE_MACHINE: &[(&str, &str)] = &[
    ("HYDI_CONTROL_FD", "7"),
    ("MPI_LOCALNRANKS", "2"),
    ("MPI_LOCALRANKID", "1"),
    ("PMI_FD", "8"),
    ("PMI_RANK", "1"),
    ("PMI_SIZE", "2"),
];

#[test]
fn hydra_on_one_machine_meets_on_loopback_at_a_port_of_its_proxy() {
    let (launcher, v) = seen(HYDRA_ONE_MACHINE);
    assert_eq!(launcher, Launcher::Pmi);
    assert_eq!(v("RANK").as_deref(), Some("1"));
    assert_eq!(v("LOCAL_WORLD_SIZE").as_deref(), Some("2"));
    assert_eq!(v("MASTER_ADDR").as_deref(), Some("127.0.0.1"));
    // Outside Hydra the parent process names the job: the same for two
    // reads in this process.
    assert!(v("MASTER_PORT").is_some());
    assert_eq!(seen(HYDRA_ONE_MACHINE).1("MASTER_PORT"), v("MASTER_PORT"));
}

#[test]
fn pmi_meets_on_loopback_or_on_mpiexecs_host() {
    let one = [
        ("PMI_RANK", "2"),
        ("PMI_SIZE", "4"),
        ("MPI_LOCALRANKID", "2"),
        ("MPI_LOCALNRANKS", "4"),
        ("PMI_PORT", "node1:45678"),
    ];
    let (launcher, v) = seen(&one);
    assert_eq!(launcher, Launcher::Pmi);
    assert_eq!(v("RANK").as_deref(), Some("2"));
    assert_eq!(v("LOCAL_RANK").as_deref(), Some("2"));
    assert_eq!(v("MASTER_ADDR").as_deref(), Some("127.0.0.1"));
    assert!(v("MASTER_PORT").is_some());
    let mut two = one.to_vec();
    two[3] = ("MPI_LOCALNRANKS", "2");
    assert_eq!(seen(&two).1("MASTER_ADDR").as_deref(), Some("node1"));
    // Without PMI_PORT across machines: no meeting point; the
    // configuration names MASTER_ADDR.
    two.retain(|(k, _)| *k != "PMI_PORT");
    let e = Config::from_lookup(env(&two)).unwrap_err().to_string();
    assert!(e.contains("MASTER_ADDR"), "{e}");
}

#[test]
fn an_srun_step_meets_on_its_first_node() {
    let step = [
        ("SLURM_PROCID", "5"),
        ("SLURM_NTASKS", "7"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_NODEID", "2"),
        ("SLURM_STEP_TASKS_PER_NODE", "2(x3),1"),
        ("SLURM_STEP_NODELIST", "gpu[07-09,12]"),
        ("SLURM_JOB_ID", "41234"),
        ("SLURM_STEP_ID", "0"),
    ];
    let (launcher, v) = seen(&step);
    assert_eq!(launcher, Launcher::Slurm);
    assert_eq!(v("RANK").as_deref(), Some("5"));
    assert_eq!(v("WORLD_SIZE").as_deref(), Some("7"));
    assert_eq!(v("LOCAL_RANK").as_deref(), Some("1"));
    assert_eq!(v("LOCAL_WORLD_SIZE").as_deref(), Some("2"));
    assert_eq!(v("MASTER_ADDR").as_deref(), Some("gpu07"));
    // The next step of the job meets elsewhere.
    let mut next = step.to_vec();
    next[7] = ("SLURM_STEP_ID", "1");
    assert_ne!(seen(&next).1("MASTER_PORT"), v("MASTER_PORT"));
    // The last node runs one task.
    let mut last = step.to_vec();
    last[3] = ("SLURM_NODEID", "3");
    assert_eq!(seen(&last).1("LOCAL_WORLD_SIZE").as_deref(), Some("1"));
}

#[test]
fn slurm_node_lists_and_task_counts_read_as_slurm_writes_them() {
    for (list, first) in [
        ("node1", "node1"),
        ("n001,n002", "n001"),
        ("a[1-2]", "a1"),
        ("gpu[07-09,12],login1", "gpu07"),
        ("rack[01-02]-ib,x", "rack01-ib"),
        ("login1,gpu[3-4]", "login1"),
    ] {
        assert_eq!(
            first_node("SLURM_STEP_NODELIST", list).unwrap(),
            first,
            "{list}"
        );
    }
    for bad in ["", "a[", "a[]"] {
        assert!(first_node("SLURM_STEP_NODELIST", bad).is_err(), "{bad:?}");
    }
    assert_eq!(
        tasks_on_node("SLURM_STEP_TASKS_PER_NODE", "4", 0).unwrap(),
        4
    );
    assert_eq!(
        tasks_on_node("SLURM_STEP_TASKS_PER_NODE", "2(x3),1", 2).unwrap(),
        2
    );
    assert_eq!(
        tasks_on_node("SLURM_STEP_TASKS_PER_NODE", "2(x3),1", 3).unwrap(),
        1
    );
    assert!(tasks_on_node("SLURM_STEP_TASKS_PER_NODE", "2(x3),1", 4).is_err());
    assert!(tasks_on_node("SLURM_STEP_TASKS_PER_NODE", "2(x3", 0).is_err());
}

#[test]
fn bad_launcher_variables_and_no_launcher_are_named() {
    let e = LaunchedJob::find(&env(&[
        ("OMPI_COMM_WORLD_RANK", "4"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
    ]))
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("OMPI_COMM_WORLD_RANK") && e.contains("not a rank of 4"),
        "{e}"
    );
    let e = LaunchedJob::find(&env(&[("PMI_RANK", "x"), ("PMI_SIZE", "2")]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("PMI_RANK"), "{e}");
    let e = LaunchedJob::find(&env(&[
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_STEP_ID", "0"),
        ("SLURM_LOCALID", "0"),
        ("SLURM_STEP_TASKS_PER_NODE", "2(x"),
    ]))
    .unwrap_err()
    .to_string();
    assert!(e.contains("SLURM_STEP_TASKS_PER_NODE"), "{e}");
    // A fallback variable is named as itself.
    let e = LaunchedJob::find(&env(&[
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_STEP_ID", "0"),
        ("SLURM_JOB_NODELIST", "a["),
    ]))
    .unwrap_err()
    .to_string();
    assert!(e.contains("SLURM_JOB_NODELIST"), "{e}");
    let e = Config::from_lookup(env(&[])).unwrap_err().to_string();
    for named in [
        "RANK",
        "OMPI_COMM_WORLD_RANK",
        "PMI_RANK",
        "SLURM_PROCID",
        "SLURM_STEP_ID",
    ] {
        assert!(e.contains(named), "{named}: {e}");
    }
}
