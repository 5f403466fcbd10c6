{{/* Names: kept short enough that "<fullname>-trainer-<index>" is a valid pod hostname (63 chars). */}}
{{- define "asyncrl.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "asyncrl.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "asyncrl.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "asyncrl.labels" -}}
helm.sh/chart: {{ include "asyncrl.chart" . }}
{{ include "asyncrl.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "asyncrl.selectorLabels" -}}
app.kubernetes.io/name: {{ include "asyncrl.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Resource names. */}}
{{- define "asyncrl.inferenceName" -}}{{ include "asyncrl.fullname" . }}-inference{{- end -}}
{{- define "asyncrl.orchestratorName" -}}{{ include "asyncrl.fullname" . }}-orchestrator{{- end -}}
{{- define "asyncrl.trainerName" -}}{{ include "asyncrl.fullname" . }}-trainer{{- end -}}

{{- define "asyncrl.claimName" -}}
{{- .Values.storage.existingClaim | default (printf "%s-data" (include "asyncrl.fullname" .)) -}}
{{- end -}}

{{- define "asyncrl.secretName" -}}
{{- .Values.apiKey.existingSecret | default (printf "%s-api-key" (include "asyncrl.fullname" .)) -}}
{{- end -}}

{{- define "asyncrl.configMapName" -}}
{{- .Values.config.existingConfigMap | default (printf "%s-config" (include "asyncrl.fullname" .)) -}}
{{- end -}}

{{- define "asyncrl.image" -}}
{{- printf "%s:%s" .Values.image.repository (toString (.Values.image.tag | default .Chart.AppVersion)) -}}
{{- end -}}

{{/* The run's output dir on the shared volume. */}}
{{- define "asyncrl.outputDir" -}}
{{- .Values.outputDir | default (printf "%s/%s" (trimSuffix "/" .Values.storage.mountPath) (include "asyncrl.fullname" .)) -}}
{{- end -}}

{{- define "asyncrl.inferenceUrl" -}}
{{- .Values.orchestrator.baseUrl | default (printf "http://%s:%d/v1" (include "asyncrl.inferenceName" .) (int .Values.inference.service.port)) -}}
{{- end -}}

{{/* torchrun processes per trainer pod. */}}
{{- define "asyncrl.trainerNproc" -}}
{{- if .Values.trainer.nprocPerNode -}}
{{- int .Values.trainer.nprocPerNode -}}
{{- else if gt (int .Values.trainer.gpusPerNode) 0 -}}
{{- int .Values.trainer.gpusPerNode -}}
{{- else -}}
1
{{- end -}}
{{- end -}}

{{- define "asyncrl.numTrainWorkers" -}}
{{- if .Values.orchestrator.numTrainWorkers -}}
{{- int .Values.orchestrator.numTrainWorkers -}}
{{- else -}}
{{- mul (int .Values.trainer.nodes) (int (include "asyncrl.trainerNproc" .)) -}}
{{- end -}}
{{- end -}}

{{/* The inference server's vLLM parallelism flags (a YAML list of args, possibly empty). */}}
{{- define "asyncrl.inferenceParallelArgs" -}}
{{- $inf := .Values.inference -}}
{{- $gpus := int $inf.gpus -}}
{{- $args := list -}}
{{- if $inf.tensorParallelSize -}}
{{- $args = concat $args (list "--tensor-parallel-size" (toString (int $inf.tensorParallelSize))) -}}
{{- end -}}
{{- if $inf.dataParallelSize -}}
{{- $args = concat $args (list "--data-parallel-size" (toString (int $inf.dataParallelSize))) -}}
{{- else if gt $gpus 1 -}}
{{- $auto := and (not .Values.config.existingConfigMap) (not (regexMatch "(?m)^\\s*(data|tensor)_parallel_size\\s*=" (.Values.config.inference | default ""))) -}}
{{- if or $inf.tensorParallelSize $auto -}}
{{- $tp := int ($inf.tensorParallelSize | default 1) -}}
{{- if ne (mod $gpus $tp) 0 -}}
{{- fail (printf "inference.gpus (%d) must be a multiple of inference.tensorParallelSize (%d)" $gpus $tp) -}}
{{- end -}}
{{- $args = concat $args (list "--data-parallel-size" (toString (div $gpus $tp))) -}}
{{- end -}}
{{- end -}}
{{- toYaml $args -}}
{{- end -}}

{{/*
GPU resources: the component's resources with <gpuResourceName>: gpus set in limits and requests (or
removed with 0 GPUs). Call with (dict "root" $ "component" C "gpus" N).
*/}}
{{- define "asyncrl.resources" -}}
{{- $res := deepCopy (.component.resources | default dict) -}}
{{- $name := .root.Values.gpuResourceName -}}
{{- $limits := $res.limits | default dict -}}
{{- $requests := $res.requests | default dict -}}
{{- $_ := unset $limits $name -}}
{{- $_ := unset $requests $name -}}
{{- if gt (int .gpus) 0 -}}
{{- $_ := set $limits $name (int .gpus) -}}
{{- $_ := set $requests $name (int .gpus) -}}
{{- end -}}
{{- if $limits -}}{{- $_ := set $res "limits" $limits -}}{{- else -}}{{- $_ := unset $res "limits" -}}{{- end -}}
{{- if $requests -}}{{- $_ := set $res "requests" $requests -}}{{- else -}}{{- $_ := unset $res "requests" -}}{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{/*
Env every container gets, then the component's own. Call with (dict "root" $ "component" C "gpus" N "apiKey" bool).
*/}}
{{- define "asyncrl.env" -}}
{{- $v := .root.Values -}}
- name: PYTHONUNBUFFERED
  value: "1"
{{- if ne $v.huggingface.home "-" }}
- name: HF_HOME
  value: {{ $v.huggingface.home | default (printf "%s/.cache/huggingface" (trimSuffix "/" $v.storage.mountPath)) | quote }}
{{- end }}
{{- if $v.huggingface.tokenSecret }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ $v.huggingface.tokenSecret }}
      key: {{ $v.huggingface.tokenSecretKey }}
{{- end }}
{{- if eq (int .gpus) 0 }}
# No GPU requested: NVIDIA's runtime then shows this container none (its image may say "all").
- name: NVIDIA_VISIBLE_DEVICES
  value: void
{{- end }}
{{- if .apiKey }}
- name: {{ $v.apiKey.envVar }}
  valueFrom:
    secretKeyRef:
      name: {{ include "asyncrl.secretName" .root }}
      key: {{ $v.apiKey.secretKey }}
{{- end }}
{{- with $v.env }}
{{ toYaml . }}
{{- end }}
{{- with .component.env }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Volume mounts of every container: the shared claim, the configs, /dev/shm. */}}
{{- define "asyncrl.volumeMounts" -}}
{{- $v := .root.Values -}}
- name: data
  mountPath: {{ $v.storage.mountPath }}
- name: config
  mountPath: /config
  readOnly: true
{{- if .component.shmSize }}
- name: dshm
  mountPath: /dev/shm
{{- end }}
{{- with $v.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "asyncrl.volumes" -}}
{{- $v := .root.Values -}}
- name: data
  persistentVolumeClaim:
    claimName: {{ include "asyncrl.claimName" .root }}
- name: config
  configMap:
    name: {{ include "asyncrl.configMapName" .root }}
{{- if .component.shmSize }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .component.shmSize }}
{{- end }}
{{- with $v.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Pod-level settings every workload shares; the component's nodeSelector/tolerations/affinity win. */}}
{{- define "asyncrl.podSpecCommon" -}}
{{- $v := .root.Values -}}
enableServiceLinks: false
{{- with $v.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.serviceAccountName }}
serviceAccountName: {{ . }}
{{- end }}
{{- with $v.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $v.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with (.component.nodeSelector | default $v.nodeSelector) }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with (.component.tolerations | default $v.tolerations) }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with (.component.affinity | default $v.affinity) }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "asyncrl.podAnnotations" -}}
checksum/config: {{ include (print .root.Template.BasePath "/configmap.yaml") .root | sha256sum }}
{{- with .root.Values.podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- with .component.podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- end -}}
